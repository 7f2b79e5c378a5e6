"""`gateway demo`: the chapter's experiments reproduced against the scripted provider."""
