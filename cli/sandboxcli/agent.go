package sandboxcli

import (
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"stasis/sandbox/microvm/agent"
)

// NewGuestAgentCmd is `stasis microvm agent`, which a microVM guest's init
// runs: exec, files and the clock, for the host's keeper.
func NewGuestAgentCmd() *cobra.Command {
	var listen string
	cmd := &cobra.Command{
		Use:   "agent --listen ADDR",
		Short: "The guest agent (run by the guest's init): exec, files, clock",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log := slog.New(slog.NewTextHandler(os.Stderr, nil)).With("component", "microvm-agent")
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			return agent.Serve(ctx, ln, log)
		},
	}
	cmd.Flags().StringVar(&listen, "listen", fmt.Sprintf(":%d", agent.Port), "address to serve on")
	return cmd
}
