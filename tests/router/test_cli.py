"""`jaxserve route` command line: configuration errors exit with code 2 before anything binds."""
import pytest

from jaxserve.cli import build_parser
from jaxserve.router.cli import main


@pytest.mark.parametrize("argv, message", [
    ([], "the router needs workers"),
    (["--worker", "127.0.0.1:1", "--decode", "127.0.0.1:2"], "cannot be mixed"),
    (["--prefill", "127.0.0.1:1"], "need decode workers"),
    (["--worker", "127.0.0.1:1", "--worker", "127.0.0.1:1"], "given twice"),
    (["--worker", "127.0.0.1:1", "--health-interval", "0"], "health interval"),
    (["--worker", "127.0.0.1:1", "--worker-cert", "c.pem"], "needs both --worker-cert and --worker-key"),
    (["--worker", "127.0.0.1:1", "--worker-api-key", "a b"], "visible ASCII"),
])
def test_configuration_errors_exit_2(argv, message, capsys):
    assert main(["route", "--port", "0", "--metrics-port", "-1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_route_is_a_jaxserve_subcommand():
    args = build_parser().parse_args(["route", "--prefill", "h:1", "--decode", "h:2", "--decode", "h:3"])
    assert (args.prefill, args.decode, args.worker) == (["h:1"], ["h:2", "h:3"], [])
