"""`qlayer console`: the web console (Starlette, server-rendered; see docs/console.md)."""
