"""`config.yaml`: the settings every layer reads (`settings`), and the field cursor that
names a bad field by its path (`fields`). Below the server: it imports nothing of it."""
