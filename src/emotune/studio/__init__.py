"""emotune studio: a local web page over the runs folder (runs table, run pages, live training progress)."""

from __future__ import annotations

import os
from pathlib import Path

from emotune.core.errors import UserError
from emotune.serve.guards import is_loopback

TOKEN_ENV = "EMOTUNE_STUDIO_TOKEN"


def studio_token(host: str, token_file: str | None) -> str | None:
    """The token a non-loopback studio requires (from --token-file, else EMOTUNE_STUDIO_TOKEN); None on loopback
    without one. Never printed and never put into a page."""
    token = None
    if token_file:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as err:
            raise UserError(f"--token-file `{token_file}` cannot be read ({err.strerror}). Name a file that holds the token.") from err
        except UnicodeDecodeError:
            raise UserError(f"--token-file `{token_file}` is not UTF-8 text. Name a file that holds the token as "
                            "text.") from None
    token = token or os.environ.get(TOKEN_ENV, "").strip() or None
    if token is None and not is_loopback(host):
        raise UserError(f"`--host {host}` makes the studio reachable from other machines, so it needs a token: set "
                        f"{TOKEN_ENV} or pass --token-file FILE. To reach a studio on a remote machine without exposing it, "
                        "keep the default --host 127.0.0.1 and tunnel: ssh -L 7860:127.0.0.1:7860 user@gpu-host.")
    if token is not None and len(token) < 16:
        raise UserError("The studio token is shorter than 16 characters; use a long random one, e.g. "
                        "`python -c 'import secrets; print(secrets.token_urlsafe(24))'`.")
    return token


def run_studio(runs: str, host: str, port: int, token_file: str | None) -> None:
    import uvicorn

    from emotune.studio.app import create_app

    if not 1 <= port <= 65535:  # uvicorn hung on a port above 65535 and ended with a resolver error below 1
        raise UserError(f"--port {port} is not a TCP port; give one from 1 to 65535, e.g. --port 7860.")
    if Path(runs).exists() and not Path(runs).is_dir():
        raise UserError(f"--runs `{runs}` is a file; give the folder `emotune run` writes run folders into (its "
                        "output_dir), e.g. --runs runs.")
    token = studio_token(host, token_file)
    app = create_app(Path(runs), host, token)
    print(f"emotune studio on http://{host if ':' not in host else f'[{host}]'}:{port}/ over {Path(runs).resolve()}"
          + (" (token required)" if token else ""), flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
