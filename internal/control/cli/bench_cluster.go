package cli

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"stasis/internal/control/bench"
)

func newBenchClusterCmd() *cobra.Command {
	var (
		o      bench.ClusterOptions
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "cluster --store postgres://… [--sizes 1250,2500,5000,10000] [--nodes 4] [--json]",
		Short: "A checkpoint over 4 nodes with the simulated provider: commit time, database transactions, memory per episode",
		Long: `cluster starts --nodes "stasis serve --node" processes with the simulated
provider (--provider sim: in-memory sandboxes that run no program, so only
stasis's own host side is measured), sharing one PostgreSQL database, starts
N episodes spread evenly over them, and takes one checkpoint through node 1's
API. For each size it prints:

  - the checkpoint's time from its row's creation to its commit (the
    database's clock), and until node 1 answered;
  - the database's transactions (pg_stat_database) over the checkpoint,
    beside those of an idle window as long, measured just before;
  - each node's RSS before any episode, once its episodes are started, and
    its high-water mark after the checkpoint, and so MiB per episode;
  - in the same run, the store's part of the checkpoint alone (4 views of
    the store putting the records 64 at once), as a baseline.

--store is a PostgreSQL URL whose role may create databases: each size (and
its store-only baseline) runs on a database of its own, dropped afterwards.
A throwaway server: initdb -D DIR -U stasis -A trust; postgres -D DIR -k DIR
-c listen_addresses= -c max_connections=300, then
--store 'postgres://stasis@/postgres?host=DIR&sslmode=disable'.
Everything the run starts (nodes, state directories, databases) is removed
when it ends, also on failure or Ctrl-C; each size is bounded by --timeout.

Targets (issue 22): no worse than linear in the episodes, 10,000 episodes
committed in <= 30 s, and <= 0.25 MiB of node RSS per episode.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			exe, err := os.Executable()
			if err != nil {
				return err
			}
			if o.Store == "" {
				o.Store = os.Getenv(StoreEnv)
			}
			if o.Store == "" {
				return &exitError{Code: 2, Err: fmt.Errorf("--store is required: a postgres:// URL whose role may create databases (or $%s)", StoreEnv)}
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			o.Exe, o.Progress = exe, cmd.ErrOrStderr()
			rows, runErr := bench.Cluster(ctx, o)
			if runErr != nil && len(rows) == 0 {
				return runErr
			}
			out := cmd.OutOrStdout()
			if asJSON {
				if err := writeJSON(out, rows); err != nil {
					return err
				}
				return runErr
			}
			tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
			fmt.Fprintln(tw, "EPISODES\tSTART s\tCOMMIT s\tANSWER s\tSTORE ONLY s\tCOMMIT/STORE\tXACTS\t/EPISODE\tIDLE XACTS\tBASE RSS MiB\tMiB/EPISODE\tPEAK MiB/EPISODE\tCOMMIT/COMMIT@FIRST\t")
			for _, r := range rows {
				base := int64(0)
				for _, m := range r.Memory {
					base = max(base, m.BaseKiB)
				}
				fmt.Fprintf(tw, "%d\t%.1f\t%.2f\t%.2f\t%.2f\t%.2f\t%d\t%.2f\t%d\t%.0f\t%.3f\t%.3f\t%.2f\t\n",
					r.Episodes, r.StartS, r.CommitS, r.CheckpointS, r.StoreOnlyS, r.CommitS/r.StoreOnlyS, r.Transactions,
					float64(r.Transactions)/float64(r.Episodes), r.IdleTransactions, float64(base)/1024, r.MiBPerEpisode, r.PeakMiBPerEpisode, r.CommitS/rows[0].CommitS)
			}
			_ = tw.Flush()
			for _, r := range rows {
				if r.Episodes == 10000 {
					verdict(out, "10,000 episodes committed", time.Duration(r.CommitS*float64(time.Second)), 30*time.Second)
				}
				mark := "meets"
				if r.PeakMiBPerEpisode > 0.25 {
					mark = "MISSES"
				}
				fmt.Fprintf(out, "%d episodes: %.3f MiB of node RSS per episode at its peak %s the 0.25 MiB target\n", r.Episodes, r.PeakMiBPerEpisode, mark)
			}
			return runErr
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.Store, "store", "", "PostgreSQL URL whose role may create databases (default: $"+StoreEnv+")")
	f.IntSliceVar(&o.Sizes, "sizes", []int{1250, 2500, 5000, 10000}, "episode counts to measure")
	f.IntVar(&o.Nodes, "nodes", 4, "stasis serve --node processes")
	f.IntVar(&o.Concurrency, "concurrency", 0, "each node's checkpoint concurrency (default: serve's)")
	f.IntVar(&o.StartConcurrency, "start-concurrency", 4, "episodes each node is asked to start at once")
	f.DurationVar(&o.NodeLease, "node-lease", time.Minute, "the nodes' --node-lease")
	f.DurationVar(&o.Timeout, "timeout", 20*time.Minute, "bound on each size's run")
	f.StringVar(&o.HeapProfile, "heap-profile", "", "directory where node 1's heap profile is written once its episodes are started (heap-N.pb.gz; go tool pprof)")
	f.StringVar(&o.CPUProfile, "cpu-profile", "", "directory where node 1's CPU profile of each checkpoint, from the request to its answer, is written (cpu-N.pb.gz; go tool pprof)")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}
