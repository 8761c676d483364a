"""zoopick application layer: command line now, the web service later."""
