package cli

import (
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"stasis/errdefs"
	"stasis/internal/control/job"
	"stasis/internal/providers/microvm"
)

// runFlags are run's flags: the job's options and how to report.
type runFlags struct {
	o                   job.Options
	asJSON, noProgress  bool
	logFormat, logLevel string
}

func newRunCmd() *cobra.Command {
	var rf runFlags
	cmd := &cobra.Command{
		Use:     "run [--tasks builtin|DIR|FILE] [--episodes N] [--harness mini|opencode|mixed] [--provider local|microvm|opensandbox|e2b] [--checkpoint-at FRACTION] [--crash] [--json]",
		Short:   "Run episodes, checkpoint them mid-way, optionally crash everything, restore, finish, verify, report",
		Long:    runLong,
		Example: runExample,
		Args:    cobra.NoArgs,
		RunE:    rf.run,
	}
	f := cmd.Flags()
	f.StringVar(&rf.o.Tasks, "tasks", "builtin", "builtin, a task directory (or a directory of them), or a SWE-bench JSONL file")
	f.StringVar(&rf.o.Repos, "repos", "", "the directory of git clones (or bundles) a SWE-bench file refers to")
	addEnvsFlag(f, &rf.o.Envs)
	f.IntVar(&rf.o.N, "episodes", 4, "how many episodes")
	f.StringVar(&rf.o.Harness, "harness", "mini", "mini, opencode, or mixed (alternating)")
	f.StringVar(&rf.o.Provider, "provider", "local", "the sandbox provider: local, microvm, opensandbox (OPENSANDBOX_URL) or e2b (E2B_API_KEY); see serve --help")
	f.StringVar(&rf.o.GuestMemory, "guest-memory", "", fmt.Sprintf("microvm: each guest's memory, e.g. 1GiB (default %d MiB)", microvm.DefaultMemMiB))
	f.StringVar(&rf.o.GuestBinary, "guest-binary", "", "microvm: the static stasis for the guest image (default: this binary)")
	f.StringVar(&rf.o.Image, "image", "", "the sandboxes' image where a task names none: oci:PATH[:TAG], docker-archive:PATH, docker://HOST/REPO:TAG or sha256:HEX (see stasis image --help); default: the provider's own root")
	f.Float64Var(&rf.o.CheckpointAt, "checkpoint-at", 0.5, "take the checkpoint when about this fraction of the model calls is made")
	f.StringVar(&rf.o.Stragglers, "stragglers", "exclude", "an episode the checkpoint cannot pause or snapshot: exclude (commit without it, named in the report) or fail (fail the checkpoint, naming it)")
	f.BoolVar(&rf.o.Crash, "crash", false, "after the checkpoint, kill the server and every sandbox, start again and restore")
	f.IntVar(&rf.o.Nodes, "nodes", 1, "run this many stasis serve --node processes on one shared --store and --blobs; with --crash every node is killed and all but the last come back, taking over its episodes")
	f.StringVar(&rf.o.Store, "store", "", "with --nodes: the PostgreSQL database the nodes share, postgres://… (default: $"+StoreEnv+")")
	f.StringVar(&rf.o.Blobs, "blobs", "", "with --nodes: the S3 bucket the nodes keep their snapshots in, s3://BUCKET/PREFIX, endpoint and credentials from the AWS environment variables (default: $"+BlobsEnv+")")
	f.BoolVar(&rf.asJSON, "json", false, "print the report as one JSON document")
	f.BoolVar(&rf.noProgress, "no-progress", false, "print no progress")
	f.StringVar(&rf.o.State, "state", "", "state directory (default: a fresh one, removed at the end)")
	f.BoolVar(&rf.o.Keep, "keep", false, "keep the state directory (store, ledgers, logs) and print where it is")
	f.DurationVar(&rf.o.TokenDelay, "token-delay", 0, "the scripted model's time per token (default 2ms), so a checkpoint falls mid-episode")
	f.DurationVar(&rf.o.Timeout, "timeout", 0, "give up after this long (default 20m)")
	f.StringVar(&rf.logFormat, "log-format", "text", "log format on stderr: text or json")
	f.StringVar(&rf.logLevel, "log-level", "warn", "log level: debug, info, warn or error")
	return cmd
}

// run runs the job and reports.
func (rf *runFlags) run(cmd *cobra.Command, _ []string) error {
	log, err := newLogger(rf.logFormat, rf.logLevel)
	if err != nil {
		return &exitError{Code: 2, Err: err}
	}
	rf.o.Log = log
	if rf.o.Store == "" {
		rf.o.Store = os.Getenv(StoreEnv)
	}
	if rf.o.Blobs == "" {
		rf.o.Blobs = os.Getenv(BlobsEnv)
	}
	errOut := cmd.ErrOrStderr()
	if !rf.noProgress && !rf.asJSON {
		if f, ok := errOut.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
			rf.o.Progress = &bars{w: errOut}
		} else {
			rf.o.Progress = &phaseLines{w: errOut}
		}
	}
	rep, err := job.Run(cmd.Context(), rf.o)
	if err != nil {
		// A bad option exits 2; anything else 1 (3 is kept
		// for a run whose episodes did not all resolve).
		if k := errdefs.Kind(err); k == errdefs.ErrInvalid || k == errdefs.ErrUnsupported {
			return &exitError{Code: errdefs.ExitRefused, Err: err}
		}
		return &exitError{Code: errdefs.ExitFailure, Err: err}
	}
	out := cmd.OutOrStdout()
	if rf.asJSON {
		if err := writeJSON(out, rep); err != nil {
			return err
		}
	} else {
		printRunReport(out, rep)
	}
	ok := rep.Resolved == len(rep.Episodes)
	for _, e := range rep.Episodes {
		ok = ok && e.LedgerVerified
	}
	if !ok {
		return &exitError{Code: 3, Err: fmt.Errorf("%d of %d episodes resolved; see the report", rep.Resolved, len(rep.Episodes))}
	}
	return nil
}

const runLong = `run is the main job. It runs N episodes on the embedded defaults (the local
provider, SQLite, the scripted model solving the tasks with their reference
solutions) through a real ` + "`stasis serve`" + ` child process, as a trainer drives it:

  1. start the episodes (tasks taken in turn; --harness mixed alternates mini
     and OpenCode);
  2. when about --checkpoint-at of their model calls are made, take a
     checkpoint (pause, snapshot, record, commit, continue);
  3. with --crash, kill the server and every sandbox with SIGKILL (no clean
     shutdown), start a new server on the same state, and restore the
     checkpoint (each episode is relaunched from its snapshot, or resumed in
     place where the snapshot kept its processes);
  4. let every episode finish, verify each (capture once), and report: per
     episode the task, harness, provider, how it was resumed, its reward, its
     model calls and whether its ledger verifies; and the checkpoint and
     restore seconds and the episodes resolved.

With --nodes N (and --store and --blobs, a PostgreSQL database and an S3
bucket) it runs N stasis serve --node processes, each with its own state
directory: the episodes are started on the nodes in turn, the checkpoint
(asked of the first node) spans them all, and --crash kills every node
and sandbox, starts all but the last node again, and restores the
checkpoint over the survivors: the lost node's episodes are forked from
its snapshots in S3 on the others.

With --provider microvm every episode runs in a QEMU microVM, pauses by
hold, and the restore resumes it in place in a fork of its VM snapshot, the
guest's wall clock kept continuous; the report gives each clock step, and
the reason for any episode relaunched instead. Without --image the guest has
busybox and stasis only (shell tasks, the mini harness); with an image such
as the Debian one that make deps-image builds (--image
oci:.tools/image/debian:stasis) every task runs, and OpenCode too (its npm
prefix reaches each guest read-only). With --provider e2b against a service
whose snapshots keep memory, episodes resume in place the same way through
the E2B API.

Nothing is left running when it returns; the state directory (a fresh one
under $TMPDIR unless --state) is removed unless --keep.

Exit status: 0 when every episode is resolved and every ledger verifies; 3
when the run completed but some episode is not resolved or a ledger does not
verify; 2 a usage error; 1 the run failed.`

const runExample = `  stasis run --episodes 8 --harness mixed --crash
  stasis run --episodes 4 --checkpoint-at 0.3 --json
  stasis run --episodes 6 --nodes 3 --crash --store postgres://stasis@db/stasis --blobs s3://stasis-ckpt/run1`

func printRunReport(out io.Writer, rep *job.Report) {
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	node := func(string) string { return "" }
	if rep.Nodes > 0 {
		node = func(s string) string { return s + "\t" }
	}
	fmt.Fprintln(tw, node("NODE")+"EPISODE\tTASK\tHARNESS\tPROVIDER\tRESUME\tVERDICT\tREWARD\tCALLS\tLEDGER")
	for _, e := range rep.Episodes {
		ledger := "verified"
		if !e.LedgerVerified {
			ledger = "NOT VERIFIED"
		}
		resume := e.Resume
		if e.ClockStep != nil {
			resume += fmt.Sprintf(" (clock %+.3fs)", *e.ClockStep)
		}
		verdict := e.Verdict
		if verdict == "" {
			verdict = "-"
		}
		fmt.Fprintf(tw, node(e.Node)+"%s\t%s\t%s\t%s\t%s\t%s\t%d\t%d\t%s\n", e.ID, e.Task, e.Harness, e.Provider, resume, verdict, e.Reward, e.ModelCalls, ledger)
	}
	_ = tw.Flush()
	// Why verdicts are errors (or runs failed as a whole), and test files
	// agents added.
	for _, e := range rep.Episodes {
		if e.Reason != "" {
			fmt.Fprintf(out, "%s %s: %s\n", e.ID, e.Verdict, e.Reason)
		}
		if len(e.TestsRemoved) > 0 {
			fmt.Fprintf(out, "%s: test files the agent added were removed before verify: %s\n", e.ID, strings.Join(e.TestsRemoved, ", "))
		}
		if len(e.TestsReverted) > 0 {
			fmt.Fprintf(out, "%s: test files the agent changed were restored before verify: %s\n", e.ID, strings.Join(e.TestsReverted, ", "))
		}
	}
	// Why episodes were relaunched, once per reason.
	var whys []string
	who := map[string][]string{}
	for _, e := range rep.Episodes {
		if e.ResumeWhy != "" && e.Resume == "relaunch" {
			if who[e.ResumeWhy] == nil {
				whys = append(whys, e.ResumeWhy)
			}
			who[e.ResumeWhy] = append(who[e.ResumeWhy], e.ID)
		}
	}
	for _, w := range whys {
		fmt.Fprintf(out, "relaunched (%s): %s\n", strings.Join(who[w], ", "), w)
	}
	fmt.Fprintf(out, "\ncheckpoint %s: %d episodes in %.2fs\n", rep.Checkpoint.ID, rep.Checkpoint.Episodes, rep.Checkpoint.Seconds)
	for _, x := range rep.Checkpoint.Excluded {
		fmt.Fprintf(out, "  excluded %s: %s\n", x.Episode, x.Reason)
	}
	if rep.Crashed {
		fmt.Fprintf(out, "crash: the server and %d sandboxes killed\n", rep.Killed)
	}
	if rep.Restore != nil {
		fmt.Fprintf(out, "restore: %.2fs\n", rep.Restore.Seconds)
	}
	fmt.Fprintf(out, "resolved: %d of %d (%d already at the checkpoint) in %.1fs\n", rep.Resolved, len(rep.Episodes), rep.ResolvedBefore, rep.Seconds)
	if rep.Errors > 0 {
		fmt.Fprintf(out, "errors: %d verdicts could not judge the work tree (not counted as the model's failures; the reasons are above)\n", rep.Errors)
	}
	if rep.State != "" {
		fmt.Fprintf(out, "state kept in %s\n", rep.State)
	}
}

// bars draws one progress bar per phase on a terminal.
type bars struct {
	w   io.Writer
	bar *progressbar.ProgressBar
}

func (b *bars) Phase(name string, total int) {
	b.bar = progressbar.NewOptions(total, progressbar.OptionSetWriter(b.w), progressbar.OptionSetDescription(fmt.Sprintf("%-22s", name)),
		progressbar.OptionShowCount(), progressbar.OptionSetWidth(30), progressbar.OptionClearOnFinish(), progressbar.OptionShowElapsedTimeOnFinish())
}
func (b *bars) Set(n int) { _ = b.bar.Set(n) }
func (b *bars) Done() {
	_ = b.bar.Finish()
	fmt.Fprintln(b.w)
}

// phaseLines prints a line per phase when stderr is not a terminal.
type phaseLines struct {
	w     io.Writer
	name  string
	total int
	last  int
}

func (p *phaseLines) Phase(name string, total int) {
	p.name, p.total, p.last = name, total, 0
	fmt.Fprintf(p.w, "%s ...\n", name)
}
func (p *phaseLines) Set(n int) { p.last = n }
func (p *phaseLines) Done()     { fmt.Fprintf(p.w, "%s: %d/%d\n", p.name, p.last, p.total) }
