"""What the tests and benchmarks start and drive: worker processes (forked from one warm
launcher), connector peers in processes of their own, simulated hosts and their links."""
