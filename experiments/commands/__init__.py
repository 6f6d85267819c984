"""Sub-commands of `pslab`: each module has register(subparsers) and run(args) -> int."""
