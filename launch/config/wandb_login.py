"""Whether ``logging=wandb_online`` can log in, known without the network.

``wandb.init`` in online mode without credentials fails in the rank-0 worker, after the
processes started; the run would train with no record. wandb finds credentials, in order, in
``WANDB_API_KEY`` (or ``WANDB_IDENTITY_TOKEN_FILE``) and in the netrc entry ``wandb login``
writes for the server (``WANDB_BASE_URL``, https://api.wandb.ai by default); this asks the same
places, through wandb's own netrc reader.
"""

from __future__ import annotations

import os
from typing import Optional

DEFAULT_HOST = "https://api.wandb.ai"


def login_problem() -> Optional[str]:
    """Why an online wandb run could not log in here (None when credentials are present)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = os.environ.get("WANDB_BASE_URL") or DEFAULT_HOST
    try:
        from wandb.sdk.lib.wbauth import read_netrc_auth

        if read_netrc_auth(host=host):
            return None
        where = f"no WANDB_API_KEY and no {host} entry in {os.environ.get('NETRC') or '~/.netrc'}"
    except Exception as e:  # noqa: BLE001 - an unreadable or malformed entry is no login either
        where = f"the netrc entry for {host} cannot be used ({e})"
    return (f"logging=wandb_online: wandb is not logged in here ({where}); run `wandb login` (or set "
            f"WANDB_API_KEY), or log offline with logging=wandb_offline and upload later with wandb sync")
