package sandboxcli

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"stasis/internal/control/relay"
	"stasis/internal/control/serve"
	"stasis/internal/insandbox/supervisor"
)

// superviseFlags are supervise's flags.
type superviseFlags struct {
	dir, mode, resume, logFormat, logLevel string
	harnessHome, cgroupRoot                string
	freeze                                 bool
	relayListen, relayUpstream, relayToken string
	relayHeartbeat                         time.Duration
	deadline, confirm, grace               time.Duration
	harnessUID, harnessGID                 int
}

func newSuperviseCmd() *cobra.Command {
	var sf superviseFlags
	cmd := &cobra.Command{
		Use:     "supervise --dir DIR [flags] -- HARNESS [ARGS...]",
		Short:   "Run a harness inside a sandbox, pausable from the host (stop, hold or hold+freeze mode)",
		Long:    superviseLong,
		Example: superviseExample,
		Args:    cobra.MinimumNArgs(1),
		RunE:    sf.run,
	}
	f := cmd.Flags()
	f.StringVar(&sf.dir, "dir", "", "session directory (created if missing)")
	f.StringVar(&sf.mode, "mode", "stop", "pause mode: stop, hold or hold+freeze")
	f.StringVar(&sf.cgroupRoot, "cgroup-root", supervisor.CgroupRoot, "hold+freeze: where the cgroup v2 file system is mounted")
	f.BoolVar(&sf.freeze, "freeze", false, "with --mode hold: also freeze the harness's control group during a pause (cgroup v2 freezer; the same as --mode hold+freeze)")
	f.DurationVar(&sf.deadline, "deadline", 0, "run budget of the harness, paused time excluded (0: none)")
	f.DurationVar(&sf.confirm, "stop-confirm-timeout", 5*time.Second, "how long a stop pause waits for every process to show stopped")
	f.DurationVar(&sf.grace, "grace", 10*time.Second, "time between SIGTERM and SIGKILL when the harness is ended")
	f.StringVar(&sf.resume, "resume-cmd", "", "shell command that relaunches the harness after an unconfirmed pause (default: the original command)")
	f.StringVar(&sf.relayListen, "relay-listen", "", "host the model relay here (host:port or unix:PATH); a pause then holds its calls")
	f.StringVar(&sf.relayUpstream, "relay-upstream", "", "the gateway's URL (http://, https:// or unix://PATH)")
	f.StringVar(&sf.relayToken, "relay-token-file", "", "the episode's credentials for the gateway (JSON; re-read at each continue)")
	f.DurationVar(&sf.relayHeartbeat, "relay-heartbeat", relay.DefaultHeartbeat, "interval of the SSE comments the relay sends a streaming client while its response is stored or held")
	f.IntVar(&sf.harnessUID, "harness-uid", 0, "run the harness as this uid, jailed (with --harness-gid; the supervisor must be root)")
	f.IntVar(&sf.harnessGID, "harness-gid", 0, "the harness's gid (with --harness-uid)")
	f.StringVar(&sf.harnessHome, "harness-home", "", "the harness's HOME, used when the harness's uid owns it (with --harness-uid; default: the environment's HOME or /etc/passwd's, when the uid owns it)")
	f.StringVar(&sf.logFormat, "log-format", "text", "log format on stderr: text or json")
	f.StringVar(&sf.logLevel, "log-level", "info", "log level: debug, info, warn or error")
	return cmd
}

// run supervises the harness args until it ends; the error carries the
// exit status.
func (sf *superviseFlags) run(cmd *cobra.Command, args []string) error {
	leanGC()
	m, log, err := sf.check(cmd)
	if err != nil {
		return err
	}
	var resumeArgv []string
	if sf.resume != "" {
		resumeArgv = []string{"/bin/sh", "-c", sf.resume}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	defer stop()
	harness, closed, err := sf.harnessUser(cmd, log)
	if err != nil {
		return err
	}
	gate, stopRelay, err := sf.startRelay(harness, log)
	if err != nil {
		return err
	}
	defer stopRelay()
	rc, err := supervisor.Run(ctx, supervisor.Options{
		Gate: gate,
		Dir:  sf.dir, CgroupRoot: sf.cgroupRoot,
		Config: supervisor.Config{
			Argv: args, ResumeArgv: resumeArgv, Mode: m,
			Deadline: sf.deadline, Grace: sf.grace, StopConfirmTimeout: sf.confirm,
		},
		Logger:  log.With("component", "supervisor"),
		Version: versionString(),
		Harness: harness,
		Closed:  closed,
	})
	if err != nil {
		return &exitError{Code: 1, Err: err}
	}
	switch {
	case rc.Error != "":
		return &exitError{Code: 1, Err: fmt.Errorf("%s", rc.Error)}
	case rc.TimedOut:
		return &exitError{Code: 124}
	case rc.ReturnCode == nil:
		return nil
	case *rc.ReturnCode < 0:
		return &exitError{Code: 128 - *rc.ReturnCode}
	case *rc.ReturnCode > 0:
		return &exitError{Code: *rc.ReturnCode}
	}
	return nil
}

// check checks the flags and returns the pause mode and the logger.
func (sf *superviseFlags) check(cmd *cobra.Command) (supervisor.Mode, *slog.Logger, error) {
	if cmd.ArgsLenAtDash() != 0 {
		return "", nil, &exitError{Code: 2, Err: fmt.Errorf("put the harness command after --, e.g. stasis supervise --dir DIR -- sh -c 'work'")}
	}
	if sf.dir == "" {
		return "", nil, &exitError{Code: 2, Err: fmt.Errorf("--dir is required: the session directory for the socket, acknowledgements and receipt")}
	}
	if sf.freeze {
		if sf.mode != string(supervisor.ModeHold) {
			return "", nil, &exitError{Code: 2, Err: fmt.Errorf("--freeze goes with --mode hold (it freezes the held harness's control group)")}
		}
		sf.mode = string(supervisor.ModeHoldFreeze)
	}
	m, err := supervisor.ParseMode(sf.mode)
	if err != nil {
		return "", nil, &exitError{Code: 2, Err: fmt.Errorf("--mode: %w", err)}
	}
	for name, d := range map[string]time.Duration{"--deadline": sf.deadline, "--stop-confirm-timeout": sf.confirm, "--grace": sf.grace} {
		if d < 0 {
			return "", nil, &exitError{Code: 2, Err: fmt.Errorf("%s must not be negative", name)}
		}
	}
	if sf.confirm == 0 {
		return "", nil, &exitError{Code: 2, Err: fmt.Errorf("--stop-confirm-timeout must be above zero")}
	}
	log, err := newLogger(sf.logFormat, sf.logLevel)
	if err != nil {
		return "", nil, &exitError{Code: 2, Err: err}
	}
	return m, log, nil
}

// harnessUser is the user --harness-uid and --harness-gid name (nil when
// neither is given), with the files that must be closed to it.
func (sf *superviseFlags) harnessUser(cmd *cobra.Command, log *slog.Logger) (*supervisor.HarnessUser, []supervisor.ClosedFile, error) {
	if !cmd.Flags().Changed("harness-uid") && !cmd.Flags().Changed("harness-gid") {
		return nil, nil, nil
	}
	if !cmd.Flags().Changed("harness-uid") || !cmd.Flags().Changed("harness-gid") {
		return nil, nil, &exitError{Code: 2, Err: fmt.Errorf("give both --harness-uid and --harness-gid")}
	}
	harness := &supervisor.HarnessUser{UID: sf.harnessUID, GID: sf.harnessGID, Home: sf.harnessHome}
	if sf.harnessHome != "" && !strings.HasPrefix(sf.harnessHome, "/") {
		return nil, nil, &exitError{Code: 2, Err: fmt.Errorf("--harness-home %q: give an absolute path", sf.harnessHome)}
	}
	if err := harness.Check(); err != nil {
		return nil, nil, &exitError{Code: 2, Err: err}
	}
	var closed []supervisor.ClosedFile
	if sf.relayToken != "" {
		closed = append(closed, supervisor.ClosedFile{Path: sf.relayToken, Access: supervisor.Read, What: "--relay-token-file"})
	}
	if p, ok := strings.CutPrefix(sf.relayUpstream, "unix://"); ok {
		closed = append(closed, supervisor.ClosedFile{Path: p, Access: supervisor.Connect, What: "--relay-upstream socket"})
	} else if sf.relayUpstream != "" {
		log.Warn("the relay's upstream is not a unix socket: the harness can reach it too (it has no token for it)", "upstream", sf.relayUpstream)
	}
	return harness, closed, nil
}

// startRelay serves the model relay when the relay flags are given; gate
// is then the relay, and stop shuts it down.
func (sf *superviseFlags) startRelay(harness *supervisor.HarnessUser, log *slog.Logger) (gate supervisor.Gate, stop func(), err error) {
	stop = func() {}
	if sf.relayListen == "" && sf.relayUpstream == "" && sf.relayToken == "" {
		return nil, stop, nil
	}
	if sf.relayListen == "" || sf.relayUpstream == "" || sf.relayToken == "" {
		return nil, stop, &exitError{Code: 2, Err: fmt.Errorf("the relay needs all of --relay-listen, --relay-upstream and --relay-token-file")}
	}
	r, err := relay.New(relay.Config{Upstream: sf.relayUpstream, TokenFile: sf.relayToken, Heartbeat: sf.relayHeartbeat, Logger: log.With("component", "relay")})
	if err != nil {
		return nil, stop, &exitError{Code: 2, Err: err}
	}
	ln, addr, err := serve.Listen(sf.relayListen)
	if err != nil {
		return nil, stop, &exitError{Code: 1, Err: fmt.Errorf("relay: %w", err)}
	}
	if p, ok := strings.CutPrefix(addr, "unix:"); ok && harness != nil {
		// The relay is the harness's: let its user connect.
		if err := os.Chmod(p, 0o666); err != nil {
			ln.Close()
			return nil, stop, &exitError{Code: 1, Err: fmt.Errorf("relay: %w", err)}
		}
	}
	srv := &http.Server{Handler: r.Handler(), ReadHeaderTimeout: 30 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return r, func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}, nil
}

const superviseLong = `supervise runs HARNESS under a supervisor that the host pauses and continues
at checkpoints through "stasis ctl".

DIR is the session directory. The supervisor writes DIR/supervisor.json (its
identity and settings), serves the control socket DIR/control.sock (mode 0600,
same uid only), writes each acknowledgement to DIR/acks/N.pause.json or
DIR/acks/N.continue.json, and on exit DIR/receipt.json. Every file is written
atomically.

Pause modes:
  stop  SIGSTOP to every process of the harness tree; the pause is confirmed
        once each shows stopped. If the tree does not stop within
        --stop-confirm-timeout (a process in uninterruptible sleep), the pause
        is not confirmed, the tree is killed, and the continue relaunches the
        harness with --resume-cmd.
  hold  acknowledged at once, no signal; the relay holds model calls.
  hold+freeze (or --mode hold --freeze)
        as hold, and the harness tree, started in a control group of its
        own, is frozen with the cgroup v2 freezer (cgroup.freeze) until the
        continue; the acknowledgement says frozen once cgroup.events does.
        Invisible to the processes, and a snapshot keeps no stopped state.
        A tree not frozen within --stop-confirm-timeout is handled as an
        unconfirmed stop. Needs a writable cgroup v2 at /sys/fs/cgroup.
In every mode paused time does not count against --deadline.

With --relay-listen, --relay-upstream and --relay-token-file the supervisor
also hosts the model relay the harness calls: a pause (in either mode)
then starts no new model call and no new delivery, waits for a delivery under
way, and the acknowledgement carries relay_delivered (the responses the
harness received whole) and relay_position (the ledger position up to which
every response is settled, delivered or abandoned by a client that had
gone: where an in-place restore cuts the ledger), or relay_unmatched when
a relay relaunched from a saved session has had no answer yet and so does
not know its place in the ledger. At each continue the
relay re-reads its token file; a raised attempt (a restore that kept the
processes) makes it issue every undelivered call again.

When the deadline passes the harness gets SIGTERM, then after --grace the
whole tree gets SIGKILL, and the receipt says timed_out. SIGTERM or SIGINT to
the supervisor ends the harness the same way. Every descendant, including
those that called setsid, is killed and reaped before the supervisor exits,
and a shim process kills them if the supervisor itself is killed.

With --harness-uid and --harness-gid the harness runs as that user, not as
the supervisor's: with no capabilities, no_new_privs, no supplementary
groups, and a seccomp filter that fails ptrace, process_vm_readv/writev,
pidfd_getfd and kcmp with EPERM; HOME is kept if that user owns it, else
taken from --harness-home or /etc/passwd. The supervisor then refuses to start unless DIR, its
acks/, the control socket, the token file and a unix upstream socket are
closed to that user (it can neither reach them nor replace them). The
supervisor runs as root (or with CAP_KILL, CAP_SETUID and CAP_SETGID) to
start and signal a harness of another uid. The supervisor is non-dumpable
in every case: no process of its uid without CAP_SYS_PTRACE can trace it or
read its memory. The control socket answers only the supervisor's own uid
and root.

Exit status: the harness's exit code (128+N when signal N ended it), 124 when
the deadline ended it, 1 when the supervisor failed.`

const superviseExample = `  stasis supervise --dir /tmp/ep1 --mode hold --deadline 30m -- opencode run "fix the bug"
  stasis ctl --dir /tmp/ep1 pause 1`
