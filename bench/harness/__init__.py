"""What several studies share: the peer comparison's runner and worker, its report, the data sets, the query
streams, the paths. Its modules import only numpy at import (the DiskANN worker runs in a venv without
fusionrag); each imports the rest where it is used."""
