from pdkv.cli import main

main()
