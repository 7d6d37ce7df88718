from bench.overhead.cli import main

main()
