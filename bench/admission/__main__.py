from bench.admission.cli import main

main()
