"""Run rules shared by every endpoint: which run a call belongs to (`keying`), admission
against limits and budgets (`governor`), booking a turn (`booking`), the upstream's reply
as booked (`replies`), and server-side runs: the driver, continuations, cancels, the governed
model, trace writing, recovery and retention. Imports the HTTP edge, never an endpoint."""
