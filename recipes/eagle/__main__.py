from recipes.eagle.cli import main

raise SystemExit(main())
