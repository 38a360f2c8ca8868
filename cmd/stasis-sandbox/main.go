// Command stasis-sandbox is the lean build of stasis that providers place in
// every sandbox: supervisor, relay, ctl and the mini harness, and nothing
// that holds task data. The commands live in package internal/insandbox/sandboxcli.
package main

import (
	"os"

	"stasis/internal/insandbox/sandboxcli"
)

func main() { os.Exit(sandboxcli.Main(os.Args[1:])) }
