package cli

import (
	"encoding/json"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"stasis/bench"
	"stasis/serve"
)

func newBenchRelayCmd() *cobra.Command {
	var (
		conc       []int
		lat, thr   int
		tokenDelay time.Duration
		asJSON     bool
	)
	cmd := &cobra.Command{
		Use:   "relay [--concurrency 1,64,512] [--token-delay D] [--json]",
		Short: "Latency added by relay plus gateway, and throughput, against calling the model directly",
		Long: `relay runs the scripted model, the gateway and one relay per concurrent
caller (each its own episode and ledger) on loopback in this process, and
measures a call through harness → relay → gateway (ledger entry fsync'd) →
model against the same call made to the model directly, interleaved in the
same run: the latency added at p50 and p99 with one caller, and the
throughput at each concurrency with the CPU time the process spent per call
(callers, relays, gateway and model all share it). --token-delay makes the model take time per
generated token, as a real one does; 0 is the relay's hardest case.

Targets: <= 1 ms added at p50; >= 90% of direct throughput at 512.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			serve.ProcsForFsync() // the gateway fsyncs each ledger entry
			r, err := bench.Relay(cmd.Context(), bench.RelayOptions{Concurrency: conc, LatencyCalls: lat, ThroughputCalls: thr, TokenDelay: tokenDelay, Progress: cmd.ErrOrStderr()})
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if asJSON {
				b, _ := json.MarshalIndent(r, "", "  ")
				fmt.Fprintln(out, string(b))
				return nil
			}
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
		},
	}
	f := cmd.Flags()
	f.IntSliceVar(&conc, "concurrency", []int{1, 64, 512}, "concurrent callers for the throughput runs")
	f.IntVar(&lat, "latency-calls", 2000, "calls for the latency sample, each way")
	f.IntVar(&thr, "throughput-calls", 4000, "calls per throughput run")
	f.DurationVar(&tokenDelay, "token-delay", 0, "the scripted model's time per generated token")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}
