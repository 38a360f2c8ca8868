package sandboxcli

import (
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"stasis/internal/providers/microvm/agent"
)

// NewGuestAgentCmd is `stasis microvm agent`, which a microVM guest's init
// runs: exec, files and the clock, for the host's keeper.
func NewGuestAgentCmd() *cobra.Command {
	var (
		listen             string
		agentUID, agentGID int
		agentHome          string
		hostOnly           bool
	)
	cmd := &cobra.Command{
		Use:   "agent --listen ADDR",
		Short: "The guest agent (run by the guest's init): exec, files, clock",
		Long: `The guest agent (run by the guest's init): exec, files, clock.

With --agent-uid and --agent-gid the guest's users are split as in the
local provider's sandboxes: a command runs as that user (no groups, HOME
--agent-home) unless the host asks for stasis's own user (root), and the
files the host writes are written as that user. With --host-only a
connection from inside the guest (loopback, or one of its own addresses) is
refused, so that the agent's user cannot drive the agent as root.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log := slog.New(slog.NewTextHandler(os.Stderr, nil)).With("component", "microvm-agent")
			c := agent.Config{Log: log, HostOnly: hostOnly}
			uidSet, gidSet := cmd.Flags().Changed("agent-uid"), cmd.Flags().Changed("agent-gid")
			if uidSet != gidSet {
				return fmt.Errorf("give both --agent-uid and --agent-gid")
			}
			if uidSet {
				c.Users = &agent.Users{UID: agentUID, GID: agentGID, Home: agentHome}
				if err := c.Users.Check(); err != nil {
					return err
				}
			}
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			return agent.ServeConfig(ctx, ln, c)
		},
	}
	f := cmd.Flags()
	f.StringVar(&listen, "listen", fmt.Sprintf(":%d", agent.Port), "address to serve on")
	f.IntVar(&agentUID, "agent-uid", 0, "run commands and write files as this uid unless the host asks for stasis's user (with --agent-gid)")
	f.IntVar(&agentGID, "agent-gid", 0, "the agent's gid (with --agent-uid)")
	f.StringVar(&agentHome, "agent-home", "", "HOME of the agent's commands (default: /root's, unchanged)")
	f.BoolVar(&hostOnly, "host-only", false, "refuse connections from inside the guest")
	return cmd
}
