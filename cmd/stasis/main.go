// Command stasis checkpoints and resumes AI-agent episodes running in
// sandboxes. The command line lives in package cli.
package main

import (
	"os"

	"stasis/internal/control/cli"
)

func main() { os.Exit(cli.Main(os.Args[1:])) }
