from k3bundle.cli.app import main

main()
