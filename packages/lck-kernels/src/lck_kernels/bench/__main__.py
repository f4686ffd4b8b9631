from lck_kernels.bench import main

raise SystemExit(main())
