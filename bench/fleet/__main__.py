from bench.fleet.cli import main

main()
