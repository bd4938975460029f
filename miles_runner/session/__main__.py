from miles_runner.session.server import main

main()
