package cli

import (
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"stasis/internal/control/bench"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/sandboxbin"
)

func newBenchCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure stasis's own speed and memory against same-run baselines",
		Long: `bench runs stasis's benchmarks on this machine and prints each figure beside
a baseline measured in the same run, so that the ratio means something on a
shared, noisy machine. BENCHMARKS.md records the results.`,
	}
	cmd.AddCommand(newBenchSuperviseCmd(), newBenchSnapshotCmd(), newBenchSandboxCmd(), newBenchRelayCmd(), newBenchCheckpointCmd(), newBenchClusterCmd(), newBenchMicroVMCmd())
	return cmd
}

func newBenchSuperviseCmd() *cobra.Command {
	var (
		sizes      []int
		modes      []string
		iterations int
		dir        string
		asJSON     bool
	)
	cmd := &cobra.Command{
		Use:   "supervise",
		Short: "Pause/continue acknowledgement latency and supervisor memory",
		Long: `supervise starts a real supervisor for each mode and harness tree size, runs
pause/continue cycles over its control socket, and reports:

  pause, continue   round-trip latency as a host sees it (p50, p99)
  status            round trip of a status request on the same socket: the
                    baseline, the cost of asking at all
  kernel stop       (stop mode) SIGSTOP to an identical tree and polling /proc
                    until all stopped, done directly with no supervisor: the
                    floor for a stop pause
  rss               the supervisor's peak resident memory (VmHWM)

Targets: hold p99 <= 1 ms; confirmed stop p99 <= 20 ms at 50 processes;
supervisor RSS <= 15 MiB.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			exe, err := sandboxbin.Path()
			if err != nil {
				return err
			}
			var ms []supervisor.Mode
			for _, m := range modes {
				mm, err := supervisor.ParseMode(m)
				if err != nil {
					return &exitError{Code: 2, Err: fmt.Errorf("--modes: %w", err)}
				}
				ms = append(ms, mm)
			}
			rows, err := bench.Supervise(cmd.Context(), bench.SuperviseOptions{
				Exe: exe, Sizes: sizes, Modes: ms, Iterations: iterations, Dir: dir, Progress: cmd.ErrOrStderr(),
			})
			if err != nil {
				return err
			}
			// The baseline, in the same run: the full stasis binary as
			// the supervisor, which is what sandboxes ran before the lean
			// build.
			full, err := os.Executable()
			if err != nil {
				return err
			}
			base, err := bench.Supervise(cmd.Context(), bench.SuperviseOptions{
				Exe: full, Sizes: []int{1}, Modes: []supervisor.Mode{supervisor.ModeHold}, Iterations: iterations, Dir: dir, Progress: cmd.ErrOrStderr(),
			})
			if err != nil {
				return fmt.Errorf("the baseline (the full binary as supervisor): %w", err)
			}
			if asJSON {
				printJSON(cmd.OutOrStdout(), map[string]any{"rows": rows, "baseline_full_binary": base[0]})
			} else {
				printSuperviseTable(cmd.OutOrStdout(), rows)
				fmt.Fprintf(cmd.OutOrStdout(), "baseline: the full stasis binary as supervisor peaks at %.1f MiB (hold, 1 process): the lean build's peak is %.2f of it\n",
					float64(base[0].PeakRSSKiB)/1024, float64(peakRSS(rows))/float64(base[0].PeakRSSKiB))
			}
			if p := peakRSS(rows); p > superviseRSSTarget {
				return &exitError{Code: 1, Err: fmt.Errorf("REGRESSION: the supervisor's peak RSS is %.1f MiB, above the %d MiB target: it runs in every sandbox and goes into every memory snapshot (see BENCHMARKS.md)", float64(p)/1024, superviseRSSTarget/1024)}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.IntSliceVar(&sizes, "sizes", []int{1, 10, 50}, "harness tree sizes, in processes")
	f.StringSliceVar(&modes, "modes", []string{"hold", "stop"}, "pause modes to measure")
	f.IntVar(&iterations, "iterations", 200, "pause/continue cycles per mode and size")
	f.StringVar(&dir, "dir", "", "where the session directories go (default: a new temporary directory); its file system's fsync cost is part of every acknowledgement")
	f.BoolVar(&asJSON, "json", false, "print the results as JSON")
	return cmd
}

// superviseRSSTarget is the supervisor's peak RSS target, in KiB.
const superviseRSSTarget = 15 * 1024

func peakRSS(rows []bench.SuperviseRow) int64 {
	var p int64
	for _, r := range rows {
		p = max(p, r.PeakRSSKiB)
	}
	return p
}

// printBench prints a benchmark's result: as indented JSON with --json,
// else with table.
func printBench[R any](out io.Writer, asJSON bool, r R, table func(io.Writer, R) error) error {
	if asJSON {
		printJSON(out, r)
		return nil
	}
	return table(out, r)
}

func ms(d time.Duration) string { return fmt.Sprintf("%.3f", float64(d)/1e6) }

func printSuperviseTable(out io.Writer, rows []bench.SuperviseRow) {
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "MODE\tPROCS\tPAUSE p50 ms\tPAUSE p99 ms\tCONT p99 ms\tSTATUS p99 ms\tPAUSE/STATUS p99\tKERNEL STOP p99 ms\tPAUSE/KERNEL p99\tRSS MiB\tSHIM RSS MiB\tUNCONFIRMED\t")
	var peak int64
	for _, r := range rows {
		kernel, kratio := "-", "-"
		if r.Kernel != nil {
			kernel = ms(r.Kernel.P99)
			kratio = fmt.Sprintf("%.2f", float64(r.Pause.P99)/float64(r.Kernel.P99))
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%.2f\t%s\t%s\t%.1f\t%.1f\t%d\t\n", r.Mode, r.Procs, ms(r.Pause.P50), ms(r.Pause.P99),
			ms(r.Continue.P99), ms(r.Baseline.P99), float64(r.Pause.P99)/float64(r.Baseline.P99), kernel, kratio,
			float64(r.PeakRSSKiB)/1024, float64(r.ShimRSSKiB)/1024, r.Unconfirmed)
		peak = max(peak, r.PeakRSSKiB)
	}
	tw.Flush()
	fmt.Fprintln(out)
	for _, r := range rows {
		switch {
		case r.Mode == supervisor.ModeHold:
			verdict(out, fmt.Sprintf("hold p99 at %d processes", r.Procs), r.Pause.P99, time.Millisecond)
		case r.Mode == supervisor.ModeStop && r.Procs == 50:
			verdict(out, "stop p99 at 50 processes", r.Pause.P99, 20*time.Millisecond)
		}
	}
	mark := "meets"
	if peak > superviseRSSTarget {
		mark = "MISSES"
	}
	fmt.Fprintf(out, "supervisor peak RSS %.1f MiB %s the 15 MiB target\n", float64(peak)/1024, mark)
}

func verdict(out io.Writer, what string, got, target time.Duration) {
	mark := "meets"
	if got > target {
		mark = "MISSES"
	}
	fmt.Fprintf(out, "%s %s ms %s the %s ms target\n", what, ms(got), mark, ms(target))
}
