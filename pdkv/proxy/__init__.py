"""`pdkv proxy`: the P/D router. Pure core in `routing`, HTTP in `http` and `app`, lifecycle in `server`."""
