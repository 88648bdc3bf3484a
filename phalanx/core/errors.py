"""The errors phalanx reports to users (a leaf module: everything may import it), and `redact`: what any message
or written file shows of a URL that carries a secret."""
from __future__ import annotations

import re

# user:password@ in a URL (object storage: s3://KEY:SECRET@bucket; a secret key may hold a '/'), and the query
# parameters of presigned or shared-access URLs whose values are secrets (S3, GCS, Azure SAS, tokens; a value is
# percent-encoded, so a '/' after it is the path going on)
_USERINFO = re.compile(r"(\b[a-zA-Z][\w+.-]*://)[^/@\s'\"]*:[^@\s'\"]*@")
_SECRET_PARAMS = re.compile(r"([?&](?:x-amz-(?:signature|credential|security-token)|x-goog-(?:signature|credential)"
                            r"|awsaccesskeyid|signature|sig|token|access_token|key|secret)=)[^&#/\s'\"]*",
                            re.IGNORECASE)
HIDDEN = "REDACTED"


def redact(text: str) -> str:
    """`text` with every URL's user:password and secret query values replaced by REDACTED (the rest kept, so the
    message still names the object): what messages, RUN/config.yaml, remote.json and the logs show. The run itself
    keeps the real URL."""
    if "://" not in text:
        return text
    return _SECRET_PARAMS.sub(rf"\g<1>{HIDDEN}", _USERINFO.sub(rf"\g<1>{HIDDEN}@", text))


class ConfigError(ValueError):
    """Bad user input (config, data, flags, checkpoint): the CLI prints it on one line and exits with 2 (a URL's
    secret redacted)."""

    def __init__(self, message: str = ""):
        super().__init__(redact(str(message)))
