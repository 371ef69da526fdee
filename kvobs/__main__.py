from kvobs.cli import main

main()
