"""`python -m gpuformers <verb>`: the same command line as the `gpuformers` console script."""

from gpuformers.cli import main

raise SystemExit(main())
