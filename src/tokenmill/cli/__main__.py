from tokenmill.cli.commands import main

raise SystemExit(main())
