from fusionrag.cli import main

raise SystemExit(main())
