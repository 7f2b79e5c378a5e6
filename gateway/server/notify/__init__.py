"""Notifications: webhooks told of approvals, stopped runs and team budgets, from the store's outbox.

`message` holds the pure parts (which lines notify, bodies, Slack text, signatures,
retries); `delivery` the background task of each replica that sends them.
"""
