package microvm

import (
	"context"

	"stasis/sandbox"
)

func init() {
	sandbox.Register(Name, sandbox.Driver{
		GatewayURL: "http://" + GatewayAddr,
		Blobs:      true,
		Open: func(ctx context.Context, c sandbox.Config) (sandbox.Provider, error) {
			guest := c.GuestBinary
			if guest == "" {
				guest = c.Binary
			}
			p, err := New(ctx, Options{
				Home: c.Home, Exe: c.Exe, ExeEnv: c.ExeEnv, GuestBinary: guest,
				GatewayDir: c.GatewayDir, GatewayServer: c.Gateway, ReadOnlyBinds: c.ReadOnlyBinds,
				MemMiB: c.MemMiB, Blobs: c.Blobs, SnapshotHook: c.SnapshotHook,
			})
			if err != nil {
				return nil, err
			}
			return p, nil
		},
	})
}
