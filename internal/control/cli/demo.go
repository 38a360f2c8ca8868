package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"stasis/internal/insandbox/supervisor"
	"stasis/internal/proc"
)

// demoTree is a harness-like process tree: two children and a setsid'd
// grandchild, each appending a line to a log every 20 ms.
const demoTree = `
log="$1"
tick() { while :; do echo "$1 $$" >> "$log"; sleep 0.02; done; }
tick child-a &
tick child-b &
setsid sh -c 'while :; do echo setsid >> "$0"; sleep 0.02; done' "$log" &
tick main
`

func newDemoCmd() *cobra.Command {
	var keep bool
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Show the supervisor pausing a process tree in stop and in hold mode",
		Long: `demo starts two supervisors over the same harness-like process tree (a shell
with two children and a setsid'd grandchild, all appending to a log), pauses
the first in stop mode and the second in hold mode, checks whether the log
grew while paused, continues both, stops them and prints the
acknowledgements as a table.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runDemo(cmd.Context(), cmd.OutOrStdout(), keep)
		},
	}
	cmd.Flags().BoolVar(&keep, "keep", false, "keep the session directories and print where they are")
	return cmd
}

type demoRow struct {
	mode      supervisor.Mode
	ack       *supervisor.Ack
	latency   time.Duration
	procs     int
	grewBytes int64
}

func runDemo(ctx context.Context, out io.Writer, keep bool) error {
	if ctx == nil {
		ctx = context.Background()
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	base, err := os.MkdirTemp("", "stasis-demo-")
	if err != nil {
		return err
	}
	if !keep {
		defer os.RemoveAll(base)
	}
	var rows []demoRow
	var receipts []*supervisor.Receipt
	for _, mode := range []supervisor.Mode{supervisor.ModeStop, supervisor.ModeHold} {
		r, rc, err := demoMode(ctx, out, exe, filepath.Join(base, string(mode)), mode)
		if rc != nil {
			receipts = append(receipts, rc)
		}
		if err != nil {
			return err
		}
		rows = append(rows, r...)
	}
	printDemo(out, rows, receipts)
	if keep {
		fmt.Fprintln(out, "session directories kept under", base)
	}
	return nil
}

// demoMode runs a supervisor in mode over the demo tree, in dir, pauses
// and continues it, and stops it: the rows of its pause and continue, and
// its receipt (nil when it had to be killed).
func demoMode(ctx context.Context, out io.Writer, exe, dir string, mode supervisor.Mode) (rows []demoRow, rc *supervisor.Receipt, err error) {
	logf := filepath.Join(dir, "harness.log")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, nil, err
	}
	fmt.Fprintf(out, "starting a supervisor in %s mode over a harness-like process tree ...\n", mode)
	c, err := supervisor.Spawn(ctx, supervisor.SpawnOptions{
		Exe: exe, Dir: dir, Flags: []string{"--mode", string(mode), "--grace", "2s", "--log-level", "warn"},
		Argv: []string{"/bin/sh", "-c", demoTree, "demo-harness", logf}, Stderr: os.Stderr,
	})
	if err != nil {
		return nil, nil, err
	}
	defer func() {
		var serr error
		if rc, serr = c.Stop(ctx, 30*time.Second); serr != nil {
			rc = nil
			c.Kill()
		}
	}()
	if err := waitFor(func() bool { return countLines(logf, "setsid") >= 2 }, 10*time.Second); err != nil {
		return nil, nil, fmt.Errorf("the demo tree did not start writing: %w", err)
	}
	for seq := int64(1); seq <= 1; seq++ {
		r, err := demoPauseContinue(ctx, c, mode, logf, seq)
		rows = append(rows, r...)
		if err != nil {
			return nil, nil, err
		}
	}
	return rows, nil, nil
}

// demoPauseContinue pauses the supervisor (seq), watches the log for a
// while, and continues it: a row each.
func demoPauseContinue(ctx context.Context, c *supervisor.Child, mode supervisor.Mode, logf string, seq int64) ([]demoRow, error) {
	var rs []demoRow
	t0 := time.Now()
	pr, err := c.Do(ctx, supervisor.Request{Op: supervisor.OpPause, Seq: seq})
	if err != nil {
		return nil, err
	}
	lat := time.Since(t0)
	st, _ := c.Do(ctx, supervisor.Request{Op: supervisor.OpStatus})
	before := fileSize(logf)
	// Watch the log for a while: a stopped tree writes nothing, a held one goes on.
	time.Sleep(300 * time.Millisecond) // observation window, not synchronisation
	grew := fileSize(logf) - before
	procs := 0
	if st != nil {
		procs = treeSize(st.Status.Identity.PID)
	}
	rs = append(rs, demoRow{mode: mode, ack: pr.Ack, latency: lat, procs: procs, grewBytes: grew})
	t0 = time.Now()
	cr, err := c.Do(ctx, supervisor.Request{Op: supervisor.OpContinue, Seq: seq})
	if err != nil {
		return nil, err
	}
	lat = time.Since(t0)
	before = fileSize(logf)
	if err := waitFor(func() bool { return fileSize(logf) > before }, 5*time.Second); err != nil {
		return nil, fmt.Errorf("the tree did not resume after continue %d: %w", seq, err)
	}
	rs = append(rs, demoRow{mode: mode, ack: cr.Ack, latency: lat, procs: procs, grewBytes: -1})
	return rs, nil
}

// printDemo prints the acknowledgements as a table, and the receipts.
func printDemo(out io.Writer, rows []demoRow, receipts []*supervisor.Receipt) {
	fmt.Fprintln(out)
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "MODE\tOP\tSEQ\tCONFIRMED\tRELAUNCHED\tIDENTITY\tWALL\tUPTIME\tLATENCY\tTREE\tLOG WHILE PAUSED")
	for _, r := range rows {
		rel, grew := "-", "-"
		if r.ack.Relaunched != nil {
			rel = fmt.Sprint(*r.ack.Relaunched)
		}
		if r.grewBytes == 0 {
			grew = "still (0 B)"
		} else if r.grewBytes > 0 {
			grew = fmt.Sprintf("grew %d B", r.grewBytes)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%v\t%s\t%s\t%.3f\t%.2f\t%s\t%d procs\t%s\n", r.mode, r.ack.Op, r.ack.Seq, r.ack.Confirmed, rel,
			r.ack.Identity, r.ack.Wall, r.ack.Uptime, r.latency.Round(10*time.Microsecond), r.procs, grew)
	}
	tw.Flush()
	fmt.Fprintln(out)
	for i, rc := range receipts {
		fmt.Fprintf(out, "receipt %d: cleanup_confirmed=%v timed_out=%v relaunches=%d paused_total=%.2fs\n",
			i+1, rc.CleanupConfirmed, rc.TimedOut, rc.Relaunches, rc.PausedTotal)
	}
	fmt.Fprintln(out, "\nstop mode froze the whole tree (the log stood still); hold mode sent no signal (the log kept growing).")
}

// waitFor polls cond until it holds or timeout passes.
func waitFor(cond func() bool, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("not within %s", timeout)
		}
		time.Sleep(5 * time.Millisecond) // poll interval, bounded by the deadline above
	}
	return nil
}

func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

func countLines(path, word string) int {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	n := 0
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, word) {
			n++
		}
	}
	return n
}

// treeSize counts the harness processes below a supervisor (the shim excluded).
func treeSize(supervisorPID int) int {
	d, err := proc.Descendants(supervisorPID)
	if err != nil {
		return 0
	}
	n := 0
	for _, s := range d {
		if s.PPID != supervisorPID {
			n++
		}
	}
	return n
}
