from fusionrag.loadtests.runner import main

raise SystemExit(main())
