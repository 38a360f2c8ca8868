package cli

import "github.com/spf13/cobra"

func newBenchCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure stasis's own speed and memory",
	}
	return cmd
}
