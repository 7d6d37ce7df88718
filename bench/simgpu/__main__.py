from bench.simgpu.cli import main

main()
