"""What the tests share: free ports, bounded waits, stub servers, record builders, fixtures' parts.

No test module imports another; each imports what it needs from here
(`from support.ports import free_port`). Every module here is plain code, no test in it.
"""

__all__: list[str] = []
