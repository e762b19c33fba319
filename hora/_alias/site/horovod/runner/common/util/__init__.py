"""``horovod.runner.common.util``: the helper modules of Horovod's launcher. Where hora has the same thing
(base64 pickles, HMAC digests, timeouts, rank and size from the environment) it is here; the rest imports
and says, when used, what hora does instead."""

LAUNCHER = ("hora's launcher (hora run / horovodrun, hora.runner) does this itself and does not export "
            "Horovod's internal helper")
