// Package cli is the stasis command line: the root command and one file per
// subcommand. cmd/stasis is only its entry point, so that tests can run the
// very same CLI inside a test binary.
package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/spf13/cobra"

	"stasis/errdefs"
	"stasis/internal/enter"
	"stasis/internal/fileop"
	"stasis/internal/insandbox/sandboxcli"
	"stasis/internal/insandbox/supervisor"
)

func versionString() string { return sandboxcli.Version() }

// exitError carries a process exit code out of a command.
type exitError = sandboxcli.ExitError

func newRoot() *cobra.Command {
	root := &cobra.Command{
		Use:   "stasis",
		Short: "Checkpoint and resume AI-agent episodes running in sandboxes",
		Long: `stasis checkpoints and resumes AI-agent episodes running in sandboxes.

At a checkpoint it pauses every agent harness (SIGSTOP, or a hold while the
relay holds its model calls), snapshots each sandbox and commits one record per
episode; on restore it forks the snapshots and continues each episode in place
or relaunches the harness from its saved session.

Inside a sandbox, "stasis supervise" runs the harness and "stasis ctl" talks to
it; everything else runs on the host.`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(sandboxcli.Commands()...)
	root.AddCommand(newRelayCmd(), newGatewayCmd(), newLedgerCmd(), newModelCmd(), newSandboxCmd(), newImageCmd(), newMicroVMCmd(), newDemoCmd(), newBenchCmd(), newCkptCmd(), newVersionCmd())
	root.AddCommand(newTasksCmd(), newRunCmd(), newServeCmd())
	return root
}

func newVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the stasis version",
		Args:  cobra.NoArgs,
		Run: func(cmd *cobra.Command, _ []string) {
			fmt.Fprintln(cmd.OutOrStdout(), "stasis", versionString())
		},
	}
}

// Main runs the stasis command line with args (without the program name) and
// returns the process exit code.
func Main(args []string) int {
	if len(args) > 0 && (args[0] == supervisor.ShimArg || args[0] == enter.Arg || args[0] == enter.HoldArg || args[0] == fileop.Arg) {
		return sandboxcli.Main(args)
	}
	root := newRoot()
	root.SetArgs(args)
	err := root.Execute()
	if err == nil {
		return 0
	}
	if code, ok := sandboxcli.ExitCode(err); ok {
		return code
	}
	fmt.Fprintln(os.Stderr, "stasis:", err)
	return errdefs.ExitCode(err) // 2 refused, 3 missing or expired, 1 failed
}

func newLogger(format, level string) (*slog.Logger, error) {
	return sandboxcli.NewLogger(format, level)
}

// printJSON prints v as indented JSON and a newline (only the newline if v
// does not marshal).
func printJSON(out io.Writer, v any) {
	b, _ := json.MarshalIndent(v, "", "  ")
	fmt.Fprintln(out, string(b))
}

// writeJSON prints v as indented JSON, one document per call: every
// command's --json output.
func writeJSON(out io.Writer, v any) error {
	enc := json.NewEncoder(out)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
