"""The layout planner behind `scaletrain plan` (command.py): which parallel layouts fit a model on N
GPUs, by memory per GPU, and how fast each would run."""
