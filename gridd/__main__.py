from gridd.cli import gridd_main

raise SystemExit(gridd_main())
