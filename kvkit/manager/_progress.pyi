from collections.abc import Callable

from kvkit.manager.requests import Progress, Request, RequestState

def advance(items: list[Progress], requests: dict[str, Request], running: RequestState, block_size: int,
            limit: int | None, null_block: int, confirm: Callable[[Request], None]) -> int: ...
