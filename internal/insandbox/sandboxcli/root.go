// Package sandboxcli owns the commands that run inside a sandbox: the
// supervisor (supervise, and the shim it starts the harness through), ctl,
// and the mini harness. It is the whole of the lean in-sandbox binary
// (cmd/stasis-sandbox), which a provider places in every sandbox, and the
// full stasis command line includes the same commands. It must not import
// task data, the scripted model or anything else an agent should not find in
// a binary it can read: TestLeanImports in cmd/stasis-sandbox holds that.
package sandboxcli

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime/debug"

	"github.com/spf13/cobra"

	"stasis/internal/enter"
	"stasis/internal/fileop"
	"stasis/internal/insandbox/supervisor"
)

// version is set at build time with -ldflags "-X stasis/internal/insandbox/sandboxcli.version=...";
// otherwise it comes from the module's build information.
var version = ""

// Version is the stasis version string: the build's, or dev-REVISION.
func Version() string {
	if version != "" {
		return version
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		rev, dirty := "", false
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
		if rev != "" {
			if len(rev) > 12 {
				rev = rev[:12]
			}
			if dirty {
				rev += "-dirty"
			}
			return "dev-" + rev
		}
	}
	return "dev"
}

// ExitError carries a process exit code out of a command, of this
// package or of the full command line's: Err, when set, is printed on
// stderr before the process exits with Code.
type ExitError struct {
	Code int
	Err  error
}

func (e *ExitError) Error() string {
	if e.Err == nil {
		return fmt.Sprintf("exit %d", e.Code)
	}
	return e.Err.Error()
}

type exitError = ExitError

// ExitCode reports the exit code that err, returned by one of these
// commands, asks for, after printing its message on stderr; ok is false for
// an error of another kind.
func ExitCode(err error) (code int, ok bool) {
	var ee *exitError
	if !errors.As(err, &ee) {
		return 0, false
	}
	if ee.Err != nil {
		fmt.Fprintln(os.Stderr, "stasis:", ee.Err)
	}
	return ee.Code, true
}

// NewLogger is the slog logger every stasis command writes to stderr.
func NewLogger(format, level string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: use debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(os.Stderr, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(os.Stderr, opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: use text or json", format)
}

func newLogger(format, level string) (*slog.Logger, error) { return NewLogger(format, level) }

func versionString() string { return Version() }

// leanGC makes the collector keep the heap close to what is live (GOGC=20
// unless GOGC is set): the supervisor runs in every sandbox and goes into
// every memory snapshot, so its peak RSS counts per episode, and its heap
// is small enough that collecting more often costs little.
// `stasis bench supervise` measures the effect.
func leanGC() {
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(20)
	}
}

// Commands are the in-sandbox commands, for a root command to add.
func Commands() []*cobra.Command {
	return []*cobra.Command{newSuperviseCmd(), newCtlCmd(), newMiniCmd(), newClockCmd()}
}

// Main runs the lean in-sandbox command line with args (without the program
// name) and returns the process exit code.
func Main(args []string) int {
	if len(args) > 0 && args[0] == enter.Arg {
		return enter.Main(args)
	}
	if len(args) > 0 && args[0] == enter.HoldArg {
		return enter.Hold()
	}
	if len(args) > 0 && args[0] == fileop.Arg {
		return fileop.Main(args, os.Stdin, os.Stdout, os.Stderr)
	}
	if len(args) > 0 && args[0] == supervisor.ShimArg {
		args = args[1:]
		if len(args) > 0 && args[0] == "--" {
			args = args[1:]
		}
		return supervisor.RunShim(args)
	}
	root := &cobra.Command{
		Use:   "stasis-sandbox",
		Short: "The part of stasis that runs inside a sandbox",
		Long: `stasis-sandbox is the lean build of stasis placed in every sandbox: the
supervisor that runs the agent harness ("supervise"), the control client the
host runs through the provider's exec API ("ctl"), and the mini harness. It
carries no task data and no reference solutions; everything else runs on the
host, in the full stasis binary.`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(Commands()...)
	vm := &cobra.Command{Use: "microvm", Short: "The microVM guest's side (the guest agent)", Hidden: true}
	vm.AddCommand(NewGuestAgentCmd())
	root.AddCommand(vm)
	root.AddCommand(&cobra.Command{
		Use: "version", Short: "Print the stasis version", Args: cobra.NoArgs,
		Run: func(cmd *cobra.Command, _ []string) { fmt.Fprintln(cmd.OutOrStdout(), "stasis", Version()) },
	})
	root.SetArgs(args)
	err := root.Execute()
	if err == nil {
		return 0
	}
	if code, ok := ExitCode(err); ok {
		return code
	}
	fmt.Fprintln(os.Stderr, "stasis:", err)
	return 1
}
