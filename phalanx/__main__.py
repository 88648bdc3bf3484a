from phalanx.cli import entry

entry()
