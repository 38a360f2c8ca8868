package cli

import (
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/pprof"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"stasis/internal/control/bench"
	"stasis/internal/control/serve"
)

func newBenchRelayCmd() *cobra.Command {
	var (
		conc       []int
		lat, thr   int
		tokenDelay time.Duration
		asJSON     bool
		cpuProf    string
		memProf    string
		profPhase  string
	)
	cmd := &cobra.Command{
		Use:   "relay [--concurrency 1,64,512] [--token-delay D] [--json]",
		Short: "Latency added by relay plus gateway, and throughput, against calling the model directly",
		Long: `relay runs the scripted model, the gateway and one relay per concurrent
caller (each its own episode and ledger) in this process (relays reach
the gateway over a unix socket, as in a sandbox; the rest is loopback TCP),
and measures a call through harness → relay → gateway (ledger entry on disk) →
model against the same call made to the model directly, interleaved in the
same run: the latency added at p50 and p99 with one caller, and the
throughput at each concurrency with the CPU time the process spent per call
(callers, relays, gateway and model all share it). Each throughput run
starts with one untimed call per caller, so connections are open and
ledgers written before the clock starts; then every caller makes
--throughput-calls/C timed calls. --token-delay makes the model take time per
generated token, as a real one does; 0 is the relay's hardest case.

Target: >= 90% of direct throughput at 512 (with a model that takes time
per token). The latency added at p50 has no target: its floor on a machine
is the extra hops plus the cheapest durable append (BENCHMARKS.md).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			serve.ProcsForFsync() // the gateway flushes each ledger entry to disk
			opts := bench.RelayOptions{Concurrency: conc, LatencyCalls: lat, ThroughputCalls: thr, TokenDelay: tokenDelay, Progress: cmd.ErrOrStderr()}
			prof := &profiles{cpuPath: cpuProf, memPath: memProf}
			profiling := cpuProf != "" || memProf != ""
			if memProf != "" {
				runtime.MemProfileRate = 64 << 10 // a sample per 64 KiB allocated, not per 512
			}
			if profiling && profPhase != "" {
				opts.Phase = func(name string) func() {
					if name != profPhase {
						return nil
					}
					prof.start(true)
					return prof.stop
				}
			} else if profiling {
				prof.start(false)
			}
			r, err := bench.Relay(cmd.Context(), opts)
			prof.stop()
			if err == nil && profiling && !prof.done {
				err = fmt.Errorf("--profile-phase %q: no such part of the run (latency, direct/C or relayed/C for a concurrency C)", profPhase)
			}
			if err == nil {
				err = prof.err
			}
			if err != nil {
				return err
			}
			return printBench(cmd.OutOrStdout(), asJSON, r, printRelayBench)
		},
	}
	f := cmd.Flags()
	f.IntSliceVar(&conc, "concurrency", []int{1, 64, 512}, "concurrent callers for the throughput runs")
	f.IntVar(&lat, "latency-calls", 2000, "calls for the latency sample, each way")
	f.IntVar(&thr, "throughput-calls", 4000, "calls per throughput run")
	f.DurationVar(&tokenDelay, "token-delay", 0, "the scripted model's time per generated token")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	f.StringVar(&cpuProf, "cpuprofile", "", "write a CPU profile to this file (go tool pprof): of the whole run, or of the part --profile-phase names")
	f.StringVar(&memProf, "memprofile", "", "write an allocation profile to this file (go tool pprof); with --profile-phase, subtract FILE.start (pprof -base)")
	f.StringVar(&profPhase, "profile-phase", "", "profile only this part of the run: latency, direct/C or relayed/C (C a concurrency)")
	return cmd
}

func printRelayBench(out io.Writer, r bench.RelayResult) error {
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "ONE CALLER\tP50 ms\tP99 ms\t")
	fmt.Fprintf(tw, "direct\t%s\t%s\t\n", ms(r.Direct.P50), ms(r.Direct.P99))
	fmt.Fprintf(tw, "relay + gateway\t%s\t%s\t\n", ms(r.Relayed.P50), ms(r.Relayed.P99))
	fmt.Fprintf(tw, "added\t%s\t%s\t\n", ms(r.AddedP50), ms(r.AddedP99))
	tw.Flush()
	fmt.Fprintln(out)
	tw = tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "CONCURRENT\tDIRECT calls/s\tRELAYED calls/s\tRELAYED/DIRECT\tCPU µs/call DIRECT\tRELAYED\t")
	var at512 *bench.RelayRow
	for i, row := range r.Rows {
		fmt.Fprintf(tw, "%d\t%.0f\t%.0f\t%.2f\t%.0f\t%.0f\t\n", row.Concurrency, row.Direct, row.Relayed, row.Ratio, row.DirectCPU, row.RelayedCPU)
		if row.Concurrency == 512 {
			at512 = &r.Rows[i]
		}
	}
	tw.Flush()
	fmt.Fprintln(out)
	verdict(out, "added latency p50", r.AddedP50, time.Millisecond)
	if at512 != nil {
		mark := "meets"
		if at512.Ratio < 0.9 {
			mark = "MISSES"
		}
		fmt.Fprintf(out, "throughput at 512 is %.0f%% of direct: %s the 90%% target\n", 100*at512.Ratio, mark)
	}
	return nil
}

// profiles are the CPU and allocation profiles of bench relay's
// --cpuprofile and --memprofile: the whole run, or one part of it.
type profiles struct {
	cpuPath, memPath string
	cpuFile          *os.File
	on, done         bool
	err              error
}

// start starts the CPU profile and, when only a part of the run is
// profiled, writes the allocations so far to MEMPROFILE.start, the base to
// subtract (go tool pprof -base MEMPROFILE.start MEMPROFILE).
func (p *profiles) start(part bool) {
	if p.on || p.done {
		return
	}
	p.on = true
	if p.cpuPath != "" {
		f, err := os.Create(p.cpuPath)
		if err == nil {
			if err = pprof.StartCPUProfile(f); err != nil {
				f.Close()
			} else {
				p.cpuFile = f
			}
		}
		if err != nil {
			p.err = fmt.Errorf("cpu profile: %w", err)
		}
	}
	if p.memPath != "" && part {
		if err := writeAllocs(p.memPath + ".start"); err != nil {
			p.err = fmt.Errorf("memory profile: %w", err)
		}
	}
}

func writeAllocs(path string) error {
	runtime.GC() // the profile shows allocations up to the last GC
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	err = pprof.Lookup("allocs").WriteTo(f, 0)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// stop ends the CPU profile and writes the allocation profile.
func (p *profiles) stop() {
	if !p.on {
		return
	}
	p.on, p.done = false, true
	if p.cpuFile != nil {
		pprof.StopCPUProfile()
		if err := p.cpuFile.Close(); err != nil && p.err == nil {
			p.err = fmt.Errorf("cpu profile: %w", err)
		}
	}
	if p.memPath != "" {
		if err := writeAllocs(p.memPath); err != nil && p.err == nil {
			p.err = fmt.Errorf("memory profile: %w", err)
		}
	}
}
