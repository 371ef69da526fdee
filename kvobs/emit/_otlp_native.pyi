# The compiled decoder's interface (kvobs/emit/_otlp_native.c); configured by kvobs.emit.native.

def configure(
    row_keys: dict[str, bool],
    renamed: tuple[tuple[str, str], ...],
    role_key: str,
    service_key: str,
    columns: tuple[str, ...],
    kind_names: tuple[str, ...],
    code_names: tuple[str, ...],
) -> None: ...
def decode(body: bytes) -> tuple[str, list[dict]] | None: ...
