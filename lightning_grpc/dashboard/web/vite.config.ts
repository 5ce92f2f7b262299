import { defaultClientConditions, defineConfig } from "vite";

// The TypeScript client (clients/typescript) is a package of the npm workspace at the repository root,
// imported as `@lightning-grpc/client/...`: the one generated copy of the contract, its typed errors and
// its semantic conventions. The `lightning-grpc-source` condition of that package's exports maps those
// imports to its TypeScript source (tsconfig.json names the same condition), so the dashboard builds
// without the client being compiled first. The bundle takes @bufbuild/protobuf and @connectrpc/connect once.
const CLIENT_SOURCE_CONDITION = "lightning-grpc-source";

// Built into ../static, which `lightning-grpc serve` serves next to the Connect gateway.
export default defineConfig({
  base: "/",
  resolve: {
    conditions: [CLIENT_SOURCE_CONDITION, ...defaultClientConditions],
    dedupe: ["@bufbuild/protobuf", "@connectrpc/connect"],
  },
  build: { outDir: "../static", emptyOutDir: true, sourcemap: true, chunkSizeWarningLimit: 1024 },
});
