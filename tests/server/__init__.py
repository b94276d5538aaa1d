"""The HTTP server, its engine process and the CLI that starts them."""
