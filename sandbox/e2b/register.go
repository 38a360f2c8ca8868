package e2b

import (
	"context"

	"stasis/sandbox"
)

func init() {
	sandbox.Register(Name, sandbox.Driver{
		Hosted: true,
		Open: func(context.Context, sandbox.Config) (sandbox.Provider, error) {
			p, err := New(FromEnv())
			if err != nil {
				return nil, err
			}
			return p, nil
		},
	})
}
