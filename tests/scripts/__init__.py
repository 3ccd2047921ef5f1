"""Programs that tests run in a fresh interpreter (signals, interpreter exit, a missing main
guard): each takes the model folder as its first argument. Not collected by pytest."""
