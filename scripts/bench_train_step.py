"""What an EAGLE-3 / DFlash training step costs, each choice side by side (see draftheads.bench.train_step).

    .venv/bin/python scripts/bench_train_step.py [--dtype bfloat16] [--parts ...] [--out FILE]
"""

from draftheads.bench.train_step import main

main()
