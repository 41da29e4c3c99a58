from chunkgen.entry import main

main()
