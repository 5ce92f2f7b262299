import { defineConfig } from "vite";

// `@client` is the TypeScript client's source (clients/typescript/src): the one generated copy of the
// contract and its semantic conventions (type-checked against that package's node_modules, so `make`
// installs both). The bundle takes @bufbuild/protobuf and @connectrpc/connect from here, once.
const client = decodeURIComponent(new URL("../../../clients/typescript/src", import.meta.url).pathname);

// Built into ../static, which `lightning-grpc serve` serves next to the Connect gateway.
export default defineConfig({
  base: "/",
  resolve: { alias: { "@client": client }, dedupe: ["@bufbuild/protobuf", "@connectrpc/connect"] },
  build: { outDir: "../static", emptyOutDir: true, sourcemap: true, chunkSizeWarningLimit: 1024 },
});
