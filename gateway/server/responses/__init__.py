"""The Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`): translated to
chat completions (`wire`, pure) and served by the chat modes (`endpoint`)."""
