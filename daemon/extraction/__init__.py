"""The extraction stage of the daemon (stage.py): inbox feeder and processor runners."""
